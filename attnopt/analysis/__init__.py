"""What the report computes from the passes' results: attention cost curves and decode-state memory."""
