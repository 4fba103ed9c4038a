"""exact: keep softmax attention as it is (the form every site falls back to)."""
