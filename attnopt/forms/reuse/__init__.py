"""reuse: block-sparse attention over the key blocks an earlier (anchor) layer's attention selected."""
