"""The shared engines, one subpackage per stage: ``asr``, ``llm``, ``tts`` and ``turn``
(voice activity and end of turn). ``contracts`` says what each stage offers the session;
``registry`` builds the backend the config names. Importing this package loads nothing."""
