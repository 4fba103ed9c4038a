"""Compiler passes: capture -> canonicalize -> detect -> plan -> rewrite -> verify."""
