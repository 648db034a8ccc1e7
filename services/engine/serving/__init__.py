"""The engine as a service: the gRPC servicer, results, request traces and the Prometheus collectors."""
