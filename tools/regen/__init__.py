"""The makers of what golden/ and tests/fixtures/ hold: tiny models (make_tiny.py, train_tiny.py,
hf_to_gguf.py), goldens from llama.cpp and transformers (make_goldens.py and the other make_*.py), the
CPU-target builds (make_cpu_target_goldens.py, cpu_targets/logits.c) and the docs' source lines
(doc_sources.py). A golden made by this project's own code checks nothing: these run the engines."""
