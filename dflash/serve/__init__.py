"""`dflash serve`: an OpenAI-compatible HTTP server doing DFlash decoding (:mod:`.server`), and
the request/response shapes it speaks (:mod:`.protocol`)."""
