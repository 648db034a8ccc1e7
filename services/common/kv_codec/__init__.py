"""The KV block codec shared by the engine (encode, decode) and the kvstore (payload checks)."""
