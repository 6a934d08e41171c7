"""The reference served over the HTTP APIs engines and harnesses speak (`python -m reference.serve`;
__main__.py says what it answers)."""
