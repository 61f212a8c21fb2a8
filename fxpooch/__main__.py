"""``python -m fxpooch``: command-line entry points."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxpooch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan, rewrite and run a small ResNet within half its memory")
    demo.add_argument("--fraction", type=float, default=0.5, help="limit as a fraction of the in-core peak")
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each stage does")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(fraction=args.fraction, steps=args.steps, device=args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
