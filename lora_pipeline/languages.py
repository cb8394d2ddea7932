"""The languages the pipeline names: ISO 639-1 code and the English name a system prompt uses."""

# ISO 639-1 code -> the name used in "reasoning language: <Name>" (Multilingual-Thinking's form).
LANGUAGE_NAMES = {"en": "English", "de": "German", "es": "Spanish", "fr": "French", "it": "Italian",
                  "ru": "Russian", "zh": "Chinese", "ja": "Japanese", "th": "Thai", "sw": "Swahili",
                  "bn": "Bengali", "te": "Telugu", "pt": "Portuguese", "nl": "Dutch"}
