"""The iteration in one process (`core.EngineCore`) and the offline API over it (`llm.LLM`,
`specsplit.LLM`). Imports torch: the coordinator and the client SDK never import this package."""
