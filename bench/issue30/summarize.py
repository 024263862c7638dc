import sys, statistics as st, collections
d = collections.defaultdict(lambda: ([], []))
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) != 5: continue
    d[tuple(p[:3])][0].append(float(p[3])); d[tuple(p[:3])][1].append(float(p[4]))
for k in sorted(d):
    w, c = d[k]; print(*k, f"wall med {st.median(w):.2f} (n={len(w)}, min {min(w):.2f})  cpu med {st.median(c):.2f}")
