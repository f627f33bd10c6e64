"""Rewrites a .cu file for the host emulation (tests/cuda_emu):
name<T><<<grid, block, smem, stream>>>(args) becomes emu::launch(grid, block, [&] { ... }),
and every `__shared__ T a[..], b;` (also `alignas(N) __shared__ ...`) gets `emu::shared_poison(a); emu::shared_poison(b);`
after it (same line), which fills the variable with 0xff bytes (NaN for floats) once per
block: a read of shared memory that no thread of the block wrote shows up.
usage: transform.py IN.cu OUT.cpp"""
import re, sys
src = open(sys.argv[1]).read()
# name<tmpl><<<grid, block, smem, stream>>>(args);  ->  emu::launch(grid, block, [&] { name<tmpl>(args); });
pat = re.compile(r'([A-Za-z_][\w:]*(?:<[^;<>]*(?:<[^;<>]*>[^;<>]*)*>)?)<<<(.*?)>>>\((.*?)\);', re.S)
def top_split(s):
    out, depth, cur = [], 0, ''
    for ch in s:
        if ch in '([{<': depth += 1
        if ch in ')]}>': depth -= 1
        if ch == ',' and depth == 0:
            out.append(cur); cur = ''
        else:
            cur += ch
    out.append(cur)
    return [x.strip() for x in out]
def rep(m):
    name, cfg, args = m.group(1), m.group(2), m.group(3)
    parts = top_split(cfg)
    return 'emu::launch(dim3(%s), dim3(%s), [&] { %s(%s); });' % (parts[0], parts[1], name, args)
out, n = pat.subn(rep, src)
shared = re.compile(r'(?m)^[ \t]*(?:alignas\(\w+\)\s+)?__shared__\s+([^;]+);')  # declarations, not comments
def poison(m):  # a declarator's name: its last identifier before any [ or =
    names = [re.findall(r'\w+', re.split(r'[\[=]', d)[0])[-1] for d in top_split(m.group(1))]
    return m.group(0) + ''.join(' emu::shared_poison(%s);' % x for x in names)
out, ns = shared.subn(poison, out)
sys.stderr.write('%s: %d launches, %d __shared__ declarations\n' % (sys.argv[1], n, ns))
open(sys.argv[2], 'w').write(out)
