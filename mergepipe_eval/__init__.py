"""Real-weight evaluation for mergepipe (issue 6): tasks from Debian text, MiniLM experts, scoring.

Kept outside the `mergepipe` package on purpose: it needs `transformers` and the
system data packages, which a merge never does. Layers, left to right:
`tasks` (labelled splits from WordNet and fortunes, pure Python) -> `minilm`
(encoder loading, probes, fine-tuning, scoring) -> `report` (tables and plot) ->
`__main__` (the command line the workflow calls).
"""
