"""Host access outside pyinfra operations: the one way the commands reach a host."""
