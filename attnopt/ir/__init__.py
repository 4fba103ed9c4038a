"""The data floor: sites, recorded calls, plans and outcomes, masks and errors.

Plain data every layer reads (passes, forms, targets, the report); it imports nothing above it.

    site.py       AttentionSite, MaskInfo, SiteNodes, NearMiss
    detection.py  Detection, what capture + detection found
    calls.py      SiteCall, Recording: what the exact model computed at each site
    outcomes.py   plans, attempts, outcomes, drifts and costs
    masks.py      run-time mask helpers (keep patterns, exact attention)
    errors.py     every error attnopt raises on purpose
"""
