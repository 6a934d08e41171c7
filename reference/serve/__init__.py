"""The reference served over the HTTP APIs engines and harnesses speak: `python -m reference.serve`
(server.py says what it answers). FastAPI and uvicorn are imported only once it serves."""
from .server import main  # noqa: F401
