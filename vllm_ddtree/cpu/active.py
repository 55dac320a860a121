"""The verify step currently running in this worker process (None outside a tree
verify).  Set by the runner around the target forward, read by the attention layers."""

step = None
