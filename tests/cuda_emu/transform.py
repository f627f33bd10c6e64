"""Rewrites a .cu file's kernel launches for the host emulation (tests/cuda_emu):
name<T><<<grid, block, smem, stream>>>(args) becomes emu::launch(grid, block, [&] { ... }).
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
sys.stderr.write('%s: %d launches\n' % (sys.argv[1], n))
open(sys.argv[2], 'w').write(out)
