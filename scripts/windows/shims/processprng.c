/* A stand-in for Windows' bcryptprimitives.dll, for tests under Wine 8 only.
 *
 * Rust's standard library (1.78 and later) takes its random bytes from
 * ProcessPrng in bcryptprimitives.dll. Windows 10 and later have that DLL;
 * Wine 8 does not, so any Rust DLL fails to load there. This one exports
 * ProcessPrng on top of RtlGenRandom (advapi32's SystemFunction036), which
 * Wine has. scripts/windows/toolchain.sh builds it into the test prefix's
 * system32; it is never part of a wheel. */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T length) {
    while (length > 0) {
        ULONG chunk = length > 0x7fffffff ? 0x7fffffff : (ULONG)length;
        if (!SystemFunction036(data, chunk)) {
            return FALSE;
        }
        data += chunk;
        length -= chunk;
    }
    return TRUE;
}
