"""What the three services share on the wire: gRPC server start-up and shutdown (`server`), TLS and bearer
tokens (`security`), telemetry, and the request/response streams (gRPC and Unix-socket). Torch-free."""
