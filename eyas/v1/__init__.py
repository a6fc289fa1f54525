"""Generated protobuf and gRPC modules of the eyas wire ABI (sources in protos/eyas/v1; do not edit)."""
