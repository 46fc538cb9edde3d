"""Speculative decoding: proposals checked by the target model in one step."""
