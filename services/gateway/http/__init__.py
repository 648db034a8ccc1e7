"""The gateway's OpenAI-compatible HTTP front: JSON in, the gRPC path's servicer, JSON or SSE out."""
