"""Offline batch summarization with a planned offload schedule, from Python.

    .venv/bin/python examples/batch_summarize.py            # in a temporary directory
    .venv/bin/python examples/batch_summarize.py DIR        # in DIR: run it again, and finished documents are skipped

Writes eight of CPython's own documentation topics to a JSONL file, asks the policy search for the
best placement under small budgets (the compute device holds only part of the weights; the rest
streams from host memory), prints the plan of the first layers, runs the job, and reads the
summaries back.
"""
import json
import sys
import tempfile
from pathlib import Path

from pydoc_data.topics import topics

from tierkv.model.loading import load_model
from tierkv.schedule.job import JobConfig, run_job
from tierkv.schedule.plan import PlanShape, format_plan, plan


def main(workdir: Path) -> None:
    inputs, out = workdir / "docs.jsonl", workdir / "summaries.jsonl"
    names = ["assert", "pass", "del", "return", "break", "continue", "global", "nonlocal"]
    inputs.write_text("".join(json.dumps({"id": n, "text": topics[n]}) + "\n" for n in names))

    print("the zig-zag schedule of 2 layers x 2 GPU batches x 2 token steps:")
    print(format_plan(plan(PlanShape(num_layers=2, num_gpu_batches=2, num_steps=2))), "\n")

    loaded = load_model("smollm2")
    config = JobConfig(inputs=inputs, out=out, gpu_budget=400 * 2**20, cpu_budget=2 * 2**30,
                       nvme_dir=workdir / "nvme", max_new_tokens=32)
    result = run_job(config, loaded=loaded,
                     on_policy=lambda p, tps: print(f"policy: {p.describe()}\npredicted {tps:.1f} tok/s"))
    print(f"{result.documents} documents summarized, {result.skipped} already done")
    if result.documents:
        print(f"measured {result.tokens_per_s:.1f} tok/s ({result.generated_tokens} tokens, prefill included)")
    print()
    for line in out.read_text().splitlines():
        record = json.loads(line)
        print(f"{record['id']:>9}: {record.get('summary', record.get('error'))[:100]!r}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
