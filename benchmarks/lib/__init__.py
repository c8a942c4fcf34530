"""What the scripts in benchmarks/ share: the modes of the end-to-end runs and their report, forced acceptance and
its drafter, model shapes and their weight bytes, the adaptive benchmark's window, vLLM's rejection samplers."""
