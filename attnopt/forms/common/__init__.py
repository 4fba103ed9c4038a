"""What every form shares: the Form and SiteModule contracts (base), decode-state plumbing
(decoding) and the fitting loop (fitting)."""
