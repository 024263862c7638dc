rule report:
    input:
        scores=all_scores(),
        notes="workflows/real/eval_notes.md",
    output:
        markdown="EVAL.md",
        plot="workflows/real/minilm_accuracy.png",
        summary="workflows/real/results/minilm.json",
    log:
        LOGS + "/report.log",
    shell:
        "{PY} -m mergepipe_eval report --results-dir {W}/minilm --notes {input.notes}"
        " --markdown {output.markdown} --plot {output.plot} --summary {output.summary} > {log} 2>&1"
