"""One process: the services' iteration with its two seams joined in place (`local.py`) and the offline API over
it (`llm.LLM`, `specsplit.LLM`). Imports torch: the coordinator and the client SDK never import this package."""
