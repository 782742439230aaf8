"""Graph passes: canonicalize spellings, match the MHA region, rewrite it to the region op."""
