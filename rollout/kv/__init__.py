"""The engine's KV cache: the paged pool and request table (`pool`), slot allocation per request (`manager`),
the radix prefix cache (`radix_cache`), and the pool's reserved virtual addresses (`virtual_memory`)."""
