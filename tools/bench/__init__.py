"""Benchmarks, each a ratio against a peer run in the same process or session: `python -m tools.bench`
(forward.py: the reference against transformers, the tower's cost per window, a run at full size),
`python -m tools.bench_accel` (numba and llama.cpp on one file: accel.py its command line, a module
per subcommand: make, run, kernels, blocks, table, gemm, vision, ceiling; engines.py the engines they time),
ggml_numba.py (the ggml-cpu twins against llama.cpp), tokenizer.py, and the floors the hot kernels
are measured against (int_floor.py, kernel_floor.py); gpu_check.sh runs the CUDA checks on a GPU machine."""
from tools.bench.forward import main  # noqa: F401 (python -m tools.bench, the README's command)
