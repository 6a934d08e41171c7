"""Check the source citations of docs/*.md against the pinned source trees.

Every fact in docs/ cites `llama.cpp/PATH:LINES`, `llama-cpp-python/PATH:LINES` or
`transformers/PATH:LINES` (docs/architecture.md, "How facts are cited"). Given those trees, this
prints each citation with the first cited lines, so a reader can see that the line says what the
note claims, and fails when a cited file is missing or a line lies past its end:

    python -m tools.doc_sources --llama-cpp LLAMA_CPP --transformers TRANSFORMERS [docs/*.md]

LLAMA_CPP is llama-cpp-python 0.3.36's `vendor/llama.cpp` (its parent holds the Python wrapper);
TRANSFORMERS is the installed transformers 5.23.0 package directory. Exit 0: every citation
resolves; 1: some do not; 2: bad input.
"""
import glob
import os
import re
import sys

from reference.cli import OneLineParser, UsageError, exit_status

CITATION = re.compile(r"\b(llama\.cpp|llama-cpp-python|transformers)/([\w./+-]+?\.(?:cpp|c|h|py|jinja|inc)):"
                      r"(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)")
SHOWN = 3  # lines printed per cited range


def citations(text):  # markdown -> [(root, path, [(first, last), ...])]
    found = []
    for root, path, spans in CITATION.findall(text):
        ranges = [tuple(int(n) for n in span.split("-")) for span in spans.split(",")]
        found.append((root, path, [(r[0], r[-1]) for r in ranges]))
    return found


def check(citation, roots):  # -> (problem or None, the cited lines)
    root, path, ranges = citation
    file = os.path.join(roots[root], path)
    if not os.path.isfile(file):
        return "no such file", []
    with open(file, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    shown = []
    for first, last in ranges:
        if not 1 <= first <= last <= len(lines):
            return f"lines {first}-{last} outside the file's {len(lines)}", shown
        shown += [f"{n}: {lines[n - 1].strip()}" for n in range(first, min(last, first + SHOWN - 1) + 1)]
    return None, shown


def report(docs, roots, out=None):  # -> number of citations that do not resolve, each printed to out (stdout)
    out, bad = out or sys.stdout, 0
    for doc in docs:
        with open(doc, encoding="utf-8") as f:
            found = citations(f.read())
        for root, path, ranges in found:
            problem, shown = check((root, path, ranges), roots)
            spans = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)
            print(f"{doc}: {root}/{path}:{spans}" + (f"  FAIL: {problem}" if problem else ""), file=out)
            for line in shown:
                print(f"    {line[:140]}", file=out)
            bad += problem is not None
    return bad


def main(argv=None):  # -> exit status
    p = OneLineParser(prog="python -m tools.doc_sources", description=__doc__)
    p.add_argument("docs", nargs="*", help="markdown files (default: docs/*.md)")
    p.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (llama-cpp-python 0.3.36 vendor/llama.cpp)")
    p.add_argument("--transformers", required=True, help="the transformers 5.23.0 package directory")
    args = p.parse_args(argv)

    def work():
        roots = {"llama.cpp": args.llama_cpp, "llama-cpp-python": os.path.dirname(os.path.dirname(
            os.path.abspath(args.llama_cpp))), "transformers": args.transformers}
        for option, tree in (("--llama-cpp", args.llama_cpp), ("--transformers", args.transformers)):
            if not os.path.isdir(tree):
                raise UsageError(f"{option} {tree}: no such directory")
        docs = args.docs or sorted(glob.glob(os.path.join("docs", "*.md")))
        if not docs:
            raise UsageError("no markdown files given and none in docs/")
        bad = report(docs, roots)
        print(f"{bad} citation(s) do not resolve" if bad else "every citation resolves")
        return 1 if bad else 0
    return exit_status("tools.doc_sources", work)


if __name__ == "__main__":
    sys.exit(main())
