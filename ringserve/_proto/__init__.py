"""Generated protobuf and gRPC modules for the wire contract in protos/ringserve/v1."""
