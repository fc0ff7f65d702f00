"""The process's own health, shared by the server and the ASR/TTS services: the loaded
heap frozen out of the garbage collector (gc_freeze), glibc's heap given back after
calls (heap), a watch on the event loop every call shares (loop_watch), OpenMP
threads and wait policy (threads), and the settings made once at start-up (process).

Imports nothing of the server, the sessions or the engines."""
