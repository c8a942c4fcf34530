"""The OpenAI-compatible HTTP API (`--http-port`): FastAPI on uvicorn in the coordinator's asyncio loop, beside the
gRPC server, on the same Engine. `protocol` (request bodies), `chat` (chat templates), `mapping` (an OpenAI body →
the coordinator's GenerateRequest: the one place the two APIs meet), `responses` (OpenAI objects and chunks),
`errors` (OpenAI error objects), `app` (routes), `server` (uvicorn in this loop)."""
