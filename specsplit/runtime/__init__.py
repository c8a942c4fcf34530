"""What runs a model server (verifier, drafter) around its model: the device thread, CUDA graphs, warm-up, KV
cache sizing, the command-line options and start-up checks, the slow-step watch, tensor-parallel ranks.
Importing this package imports nothing; each module that needs torch imports it itself."""
