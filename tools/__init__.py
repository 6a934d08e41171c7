"""The tools, by job: parity/ (the users' workflows: goldens, diffs, bisection, perplexity, CI gates),
regen/ (the makers of golden/ and tests/fixtures/), bench/ (benchmarks as ratios against a peer), and
what they share: common.py (the pinned llama.cpp, atomic writes, plots) and synthetic.py (the fixture
library of synthetic GGUFs and test images). Each `tools/<name>.py` beside them keeps a README command
`python -m tools.<name>` working: it runs the tool's main."""
