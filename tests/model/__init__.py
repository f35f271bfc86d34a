"""Reference models: the rules of the real code, stated as small plain Python."""
