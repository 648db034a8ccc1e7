"""The in-loop safety gate: the classifier head on hidden states and loading and verifying its file."""
