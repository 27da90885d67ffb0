"""Generated gRPC modules for proto/ps.proto; regenerate with scripts/gen_proto.py."""
