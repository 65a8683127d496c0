"""``python -m fusedops demo | check``."""

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedops")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="every operator forward+backward on every backend this "
                                       "machine runs, against the float64 reference")
    demo.add_argument("--no-interpreter", action="store_true",
                      help="on a machine without CUDA, skip the Triton interpreter rows")
    sub.add_parser("check", help="environment report: versions, device, backends per operator")
    args = parser.parse_args(argv)
    import torch
    if args.command == "demo" and not torch.cuda.is_available() and not args.no_interpreter \
            and "triton" not in sys.modules:
        # without a GPU the Triton kernels can still run, slowly, on the CPU interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import demo as demo_module
    if args.command == "demo":
        return demo_module.run_demo()
    return demo_module.run_check()


if __name__ == "__main__":
    sys.exit(main())
