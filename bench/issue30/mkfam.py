from mergepipe.commands import demo
demo.PRESETS["qwen2s"] = demo.Preset(640, 12, 10, 2, 3456, 32000, context=32768, tied=True)
demo.make_family("/tmp/i30/fam", preset="qwen2s", n_experts=3)
