"""One model replica: the coordinator actor, its worker group, recovery, weight hot-swap and its gRPC server."""
