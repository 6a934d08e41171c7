"""`pytest -p tools.pytest_parity`: the plugin's name since it was a module here; it is tools.parity.pytest_parity."""
pytest_plugins = ["tools.parity.pytest_parity"]
