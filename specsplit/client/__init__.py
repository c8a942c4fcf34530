"""The client SDK: `Client`, `AsyncClient` (`sdk`), what they return (`results`) and its errors (`errors`:
those that cross a service boundary, and `UsageError`). Torch-free; `specsplit/__init__.py` re-exports the
SDK's names."""
