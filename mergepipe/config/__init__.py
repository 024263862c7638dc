"""params.yaml: the typed, validated merge description, and mergekit's YAML translated into it."""
