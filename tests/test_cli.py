{
  "format": "tierkv-run-config",
  "version": 1,
  "gpu_budget": "261888KiB",
  "gpu_policy": "arc",
  "cpu_budget": "1048320KiB",
  "cpu_policy": "arc",
  "prefetch": "next-layer",
  "tuned": {
    "trace": "/work/main/tests/test_cli.py",
    "policies": {
      "gpu": "arc",
      "cpu": "arc"
    },
    "prefetch": "next-layer",
    "bytes_by_link": {
      "new->cpu": 50331648,
      "new->gpu": 268173312
    },
    "served": {
      "gpu": 21868,
      "cpu": 3410,
      "arriving": 0,
      "nowhere": 0
    },
    "hit_rates": {
      "gpu": 0.8651000870322019,
      "cpu": 1.0
    },
    "stall_s": 0.0,
    "decode_stall_s": 0.0,
    "put_s": 0.03157115985070426,
    "compute_s": 30.240042723999068,
    "total_s": 30.271613883849774,
    "pool_s": {},
    "moved_bytes": 0,
    "stall_fraction": 0.0
  }
}
