"""Operator and developer tools that ship with tieredkv (tiny model, demo)."""
