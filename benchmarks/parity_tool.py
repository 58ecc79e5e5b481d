"""The vLLM parity tool (benchmarks/parity/): record a server's answers to the corpus, compare two
captures, or write docs/vllm-differences.md from the accepted differences.

  python benchmarks/parity_tool.py record URL OUT.json [--server NAME]
  python benchmarks/parity_tool.py compare VLLM.json OURS.json   # exit 1: unaccepted differences
  python benchmarks/parity_tool.py docs                          # rewrite docs/vllm-differences.md

The capture of vLLM the test replays is tests/parity/data/vllm_capture.json (how it was made: the
header of benchmarks/parity/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.compare import accepted_by, compare, differing_requests
from parity.docs import DOCS_PAGE, render
from parity.record import dump, record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="send the corpus to URL, write the capture to OUT")
    rec.add_argument("url")
    rec.add_argument("out", type=Path)
    rec.add_argument("--server", default="unnamed", help="the server's name in the capture")
    cmp = sub.add_parser("compare", help="list the differences of OURS from VLLM")
    cmp.add_argument("vllm", type=Path)
    cmp.add_argument("ours", type=Path)
    sub.add_parser("docs", help="write docs/vllm-differences.md from accepted.py")
    args = parser.parse_args()
    if args.command == "record":
        args.out.write_text(dump(record(args.url, args.server)))
        return 0
    if args.command == "docs":
        DOCS_PAGE.write_text(render())
        return 0
    differences = compare(json.loads(args.vllm.read_text()), json.loads(args.ours.read_text()))
    unaccepted = [d for d in differences if accepted_by(d) is None]
    for difference in differences:
        print(("  accepted " if accepted_by(difference) else "DIFFERENT ") + str(difference))
    differing = differing_requests(differences)
    print(f"{len(differing)} requests differ ({len(differences)} differences, "
          f"{len(unaccepted)} not accepted)")  # fmt: skip
    return 1 if unaccepted else 0


if __name__ == "__main__":
    sys.exit(main())
