"""``tierkv store verify|repair``: check a store whole, and repair what it can (see tierkv.session.scrub)."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from tierkv.flags import add_flags, build, given, path_arg
from tierkv.model.settings import SessionConfig


def add_store(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="check every block and sparse index of a store; repair what is damaged",
                       description="verify: read every block and stored sparse index under --nvme-dir and check "
                                   "it (exit 1 if anything is damaged). repair: drop what fails and compute the "
                                   "damaged pages of each stored document again, with the model and sparse "
                                   "settings of the run that stored it.")
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    verify = actions.add_parser("verify", help="check everything under --nvme-dir; exit 1 if anything is damaged")
    verify.add_argument("--nvme-dir", type=path_arg, required=True, metavar="DIR", help="the store's directory")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(func=cmd_store)
    repair = actions.add_parser("repair", help="drop what fails its checks, compute damaged sparse pages again",
                                description="Give the flags of the run that stored the documents (model, dtype, "
                                            "sparse settings): a document stored under others is reported, "
                                            "not repaired.")
    add_flags(repair, SessionConfig)
    for action in repair._actions:       # the store to repair: required here, where a run may go without one
        if "--nvme-dir" in action.option_strings:
            action.required = True
    repair.add_argument("--json", action="store_true", help="print one JSON object")
    repair.set_defaults(func=cmd_store)


def cmd_store(args: argparse.Namespace) -> int:
    from tierkv.session.scrub import repair_store, verify
    if args.action == "verify":
        verdict = verify(args.nvme_dir)
    else:
        config = build(SessionConfig, given(args, SessionConfig))
        repaired = repair_store(config.tiers.nvme_dir, config)
        verdict = verify(config.tiers.nvme_dir)
        if args.json:   # one object: what the repair did, and the check after it
            print(json.dumps({"action": "repair", "clean": verdict.clean, "repair": _fields(repaired),
                              "verify": _fields(verdict)}, default=str))
            return 0 if verdict.clean else 1
        _show(repaired, "repair")
    if args.json:
        print(json.dumps({"action": "verify"} | _fields(verdict), default=str))
    else:
        _show(verdict, "verify")
    return 0 if verdict.clean else 1


def _fields(verdict) -> dict:
    return {"clean": verdict.clean} | asdict(verdict)


def _show(verdict, action: str) -> None:
    print(f"{action}:")
    for line in verdict.lines():
        print(f"  {line}")
