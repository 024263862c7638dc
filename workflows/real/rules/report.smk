rule report:
    input:
        scores=all_scores(),
        smollm_scores=sm_all_scores(),
        notes="workflows/real/eval_notes.md",
        smollm_notes="workflows/real/smollm_notes.md",
        strategies="workflows/real/results/strategies_minilm.json",
        strategies_s1="workflows/real/results/strategies_minilm_s1.json",
        strategies_seeds="workflows/real/results/strategies_minilm_seeds.json",
        strategies_notes="workflows/real/strategies_notes.md",
        smollm_strategies="workflows/real/results/strategies_smollm.json",
        smollm_strategies_extra=SM["strategy_screen"].get("extra_results", []),
        smollm_strategies_notes="workflows/real/smollm_strategies_notes.md",
    output:
        markdown="workflows/real/EVAL.generated.md",  # the generated tables; EVAL.md is the hand-written report
        plot="workflows/real/minilm_accuracy.png",
        summary="workflows/real/results/minilm.json",
        smollm_plot="workflows/real/smollm_accuracy.png",
        smollm_summary="workflows/real/results/smollm.json",
    params:
        seeds=",".join(str(s) for s in SEEDS),
        smollm_strategies_extra=" ".join(f"--smollm-strategies-result {r}"
                                         for r in SM["strategy_screen"].get("extra_results", [])),
    log:
        LOGS + "/report.log",
    shell:
        "{PY} -m mergepipe_eval report --results-dir {W}/minilm --notes {input.notes}"
        " --seeds {params.seeds} --seed-check probe"
        " --markdown {output.markdown} --plot {output.plot} --summary {output.summary}"
        " --smollm-results-dir {W}/smollm --smollm-notes {input.smollm_notes}"
        " --smollm-plot {output.smollm_plot} --smollm-summary {output.smollm_summary}"
        " --strategies-result {input.strategies} --strategies-result {input.strategies_s1}"
        " --strategies-notes {input.strategies_notes}"
        " --strategies-plot workflows/real/strategies_minilm.png --strategies-seeds {input.strategies_seeds}"
        " --smollm-strategies-result {input.smollm_strategies} {params.smollm_strategies_extra}"
        " --smollm-strategies-notes {input.smollm_strategies_notes}"
        " --smollm-strategies-plot workflows/real/strategies_smollm.png"
        " > {log} 2>&1"
