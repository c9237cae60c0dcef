"""``python -m benchmarks NAME [options]``: one bench (decode, verify_cost, ...) or ``all`` (run_all)."""

import importlib
import sys

from benchmarks.run_all import BENCHES

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print(f"usage: python -m benchmarks {{all,{','.join(BENCHES)},report}} [options]")
    raise SystemExit(0 if len(sys.argv) >= 2 else 2)
name, argv = sys.argv[1], sys.argv[2:]
module = importlib.import_module("benchmarks.run_all" if name == "all" else f"benchmarks.{name}")
raise SystemExit(module.main(argv))
