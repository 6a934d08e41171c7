"""The workflows of the model's users: goldens from an engine (golden.py, its engines in engines/, a
prompt's files in golden_files.py, corpus mode in corpus.py), their comparison (diff.py), layer
bisection over named trace points (bisect.py, with the dump readers dump_parse.py, hf_names.py and
hf_trace.py), perplexity and KL divergence (perplexity.py, with perplexity_arithmetic.py,
perplexity_statistics.py and kld_files.py) and the CI parity gates (pytest_parity.py)."""
