"""Session files: the frame format, and replay / report / merge over them."""
